"""Scheduling and KV-block bookkeeping. Pure Python: nothing under core/ imports torch or
touches tensors; what crosses to the workers is `SchedulerOutput`, plain picklable data."""
