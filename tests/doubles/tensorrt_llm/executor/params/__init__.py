# mirrors tensorrt_llm/executor/params/ (1.4 era, @ 1f064c467a211b4168555ca06bb9b801c64eae20):
# the request-contract modules moved here from tensorrt_llm/*_params.py. The double keeps
# its SamplingParams here on both lines; 1.2's tensorrt_llm.sampling_params re-exports it.
