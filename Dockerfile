FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline pipeline
COPY graphstore graphstore
COPY jobs jobs
RUN pip install --no-cache-dir .
ENV DGLBACKEND=pytorch
ENTRYPOINT []
CMD ["jobs", "--help"]
