# CUDA image for GPU serving. Build: docker build -t lightllm .
# Run:   docker run --gpus all --shm-size 8g -v /models:/models -p 8000:8000 lightllm --model_dir /models/NAME --host 0.0.0.0
# The server keeps its request records in /dev/shm: Docker's default 64 MiB holds none of them (the
# start-up line names the size a model needs; docs/EN/memory.md). In Kubernetes, mount an
# emptyDir with medium: Memory on /dev/shm.
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

# gcc and the Python headers: Triton (the default attention backend on CUDA) compiles its launcher
# at first use, and the runtime image has neither.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/lightllm
COPY requirements.txt requirements-gpu.txt setup.py ./
RUN python3 -m pip install --no-cache-dir -r requirements-gpu.txt
COPY lightllm ./lightllm
RUN python3 -m pip install --no-cache-dir --no-deps -e .
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "lightllm.server.api_server"]
