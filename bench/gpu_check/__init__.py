"""The prepared GPU check: NCCL, bf16 training steps, step time and MFU (`python -m bench.gpu_check`)."""
