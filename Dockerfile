# karakvd images, multi-stage. Two targets:
#   docker build --target cpu  -t karakvd:cpu  .   (the default target: Debian 12, CPU backend)
#   docker build --target cuda -t karakvd:cuda .   (Debian 12 + CUDA toolkit, see below)
# Both runtime images hold karakvd, the karakv CLI (also the HEALTHCHECK), the C++ SDK library and
# the synthetic worker, run as the non-root user 10001, and serve on /run/karakv/karakv.sock.
#
# CUDA: the builder has nvcc (Debian's nvidia-cuda-toolkit, non-free) and the runtime the CUDA
# runtime library (libcudart). CMake builds kernels/cuda when nvcc works with the host compiler:
# Debian 12's toolkit is CUDA 11.8, whose nvcc refuses g++ 12, so this image builds the CPU
# backend only; with a CUDA 12+ toolkit in the builder it gains --backend=cuda.

# ---------------------------------------------------------------- build: sources and toolchain
FROM debian:12 AS build-base
# The build packages of scripts/setup.sh (tests and benchmarks are not built here).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      cmake ninja-build g++ pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev libspdlog-dev prometheus-cpp-dev libxsmm-dev \
      libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libhiredis-dev libxxhash-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY cmake/ cmake/
COPY proto/ proto/
COPY kernels/ kernels/
COPY server/ server/
COPY client/ client/
COPY examples/ examples/
COPY util/ util/
COPY docker/build.sh docker/build.sh
# The image has no .git: --version and karakv_build_info show this revision ("unknown" when empty):
# docker build --build-arg KARAKV_GIT_REVISION=$(git rev-parse --short HEAD) .
ARG KARAKV_GIT_REVISION=""
ENV KARAKV_GIT_REVISION=$KARAKV_GIT_REVISION

# ---------------------------------------------------------------- build: CPU
FROM build-base AS build-cpu
RUN sh docker/build.sh /dist

# ---------------------------------------------------------------- build: CUDA toolkit present
FROM build-base AS build-cuda
RUN sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' \
      /etc/apt/sources.list.d/debian.sources \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nvidia-cuda-toolkit \
 && rm -rf /var/lib/apt/lists/* \
 && nvcc --version
RUN sh docker/build.sh /dist

# ---------------------------------------------------------------- runtime: shared base
FROM debian:12-slim AS runtime-base
# Only the shared libraries the binaries load (their dependencies come with them).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 libspdlog1.10 libfmt9 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libgomp1 libzmq5 libhiredis0.14 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 karakv \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin karakv \
 && mkdir -p /run/karakv \
 && chown 10001:10001 /run/karakv
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["karakv", "--target=unix:/run/karakv/karakv.sock", "--timeout=4", "health"]
ENTRYPOINT ["karakvd"]
CMD ["--socket=/run/karakv/karakv.sock"]

# ---------------------------------------------------------------- runtime: CUDA
FROM runtime-base AS cuda
RUN sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' \
      /etc/apt/sources.list.d/debian.sources \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libcudart11.0 \
 && rm -rf /var/lib/apt/lists/*
# The NVIDIA container runtime mounts the driver libraries into containers that ask for them.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build-cuda /dist/ /usr/local/
RUN ldconfig
USER 10001:10001

# ---------------------------------------------------------------- runtime: CPU (default target)
FROM runtime-base AS cpu
COPY --from=build-cpu /dist/ /usr/local/
RUN ldconfig
USER 10001:10001
