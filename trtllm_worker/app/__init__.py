"""The application, on top of every other layer: the `trtllm-worker` command (`cli`) and
its two composition roots, the worker (`service`) and its dry run (`check`)."""
