# CUDA image for GPU serving. Build: docker build -t lightllm .
# Run:   docker run --gpus all -v /models:/models -p 8000:8000 lightllm --model_dir /models/NAME --host 0.0.0.0
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/lightllm
COPY requirements.txt requirements-gpu.txt setup.py ./
RUN python3 -m pip install --no-cache-dir -r requirements-gpu.txt
COPY lightllm ./lightllm
RUN python3 -m pip install --no-cache-dir --no-deps -e .
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "lightllm.server.api_server"]
