"""One runner per step kind: the worker picks one for each plan (worker/worker.py)."""
