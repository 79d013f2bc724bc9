"""Running compressed models: the bundled decoder (a plain-PyTorch transformer over packed int4/int8
kernels for CPU and GPU, with a memory planner, continuous batching, speculative decoding and
layer streaming), the `generate` stage, and the `slimlm generate`, `chat`, `plan` and `serve`
commands (`serve`: an OpenAI-compatible HTTP server)."""
