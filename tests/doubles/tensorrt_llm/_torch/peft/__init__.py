"""The double's stand-in for a package of tensorrt_llm (see the modules inside)."""
