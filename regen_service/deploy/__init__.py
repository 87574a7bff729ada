"""Deployment helpers: SGLang's launch command with a draft preflight, and the speculative benchmark."""
