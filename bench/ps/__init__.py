"""bench.ps: the parameter server's trade-off against collective data parallelism, measured
(bytes per step against the formulas; loss against wall time for bsp, ssp and asp, without and
with a straggler). Run `python -m bench.ps`; bench/ps/main.py says what each number is."""
