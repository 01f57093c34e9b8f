# syntax=docker/dockerfile:1
# The undying image for GPU nodes: CUDA PyTorch, a pinned Ray, and undying with its runtime
# extras, installed from this checkout. KubeRay (deploy/kuberay) and Ray's cluster launcher
# (deploy/ray) run it; deploy/README.md says how to build, push and use it. The CPU variant,
# for laptops and CI, is Dockerfile.cpu.
#
#   make image        (docker build -t ghcr.io/undying-project/undying:0.1.0-gpu .)

# torch 2.13.0's own wheels are built against CUDA 13.0 and cuDNN 9.
FROM pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime

# The manifests' rayVersion names this version (KubeRay builds the job submitter's command from
# it); undying itself accepts any Ray from 2.40.
ARG RAY_VERSION=2.60.0
# The base image's torch.
ARG TORCH_VERSION=2.13.0

LABEL org.opencontainers.image.title="undying" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="Fault-tolerant orchestrator for large-model training on Ray" \
      org.opencontainers.image.licenses="Apache-2.0"

# wget: KubeRay's readiness and liveness probes run it in the Ray container. rsync and ssh: Ray's
# cluster launcher syncs files into the container, and the head's autoscaler reaches the workers
# over SSH from inside it. The versions are the base image's Ubuntu release's.
# g++: `train.compile` builds its kernels with a host compiler (Triton's launcher on GPUs, Inductor's
# C++ kernels on CPUs), which a runtime image lacks: every rank's first compiled step would fail.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget rsync openssh-client g++ \
    && rm -rf /var/lib/apt/lists/*

# The pinned heavy dependencies in a layer of their own, before any source: an edit of the
# checkout rebuilds only the layer below. torch==TORCH_VERSION holds the base image's torch (and
# its CUDA build): undying asks only for torch>=2.13.0, which a newer release on PyPI would satisfy.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" "ray[default,data]==${RAY_VERSION}" \
    && groupadd --gid 10001 undying \
    && useradd --create-home --uid 10001 --gid 10001 --shell /bin/bash undying

# The checkout is bind-mounted for its install (BuildKit), so that no layer keeps its files; the
# pins again, so that pip resolves undying's ranges against them. boto3 for Ray's cluster launcher:
# its AWS node provider, run by the head's autoscaler inside this image, imports it (pip picks the
# release whose botocore s3fs's aiobotocore pins).
RUN --mount=type=bind,source=.,target=/tmp/undying-src,rw \
    pip install --no-cache-dir "torch==${TORCH_VERSION}" "ray[default,data]==${RAY_VERSION}" \
        "/tmp/undying-src[s3,plot,tensorboard,wandb]" "boto3>=1.34"

# A numeric user, so that Kubernetes' runAsNonRoot can check it. Ray writes under /tmp/ray and
# the home directory, both writable by it.
ENV HOME=/home/undying PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/undying

# No ENTRYPOINT: KubeRay replaces the command with its `ray start`, and Ray's cluster launcher
# starts the container with `bash`, which an ENTRYPOINT would swallow. `docker run IMAGE undying
# run job.yaml` runs a job on the container's own local Ray.
CMD ["undying", "--help"]
