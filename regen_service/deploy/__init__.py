"""Deployment: SGLang and vLLM launch commands with a draft preflight, bench-spec, and Flower behind auth."""
