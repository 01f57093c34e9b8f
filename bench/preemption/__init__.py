"""`python -m bench.preemption`: what a worker node's end costs a job, drained first against lost
(see bench/preemption/main.py)."""
