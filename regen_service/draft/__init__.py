"""The draft as files: what the trainer writes and what the serving engines load.

config.py (`DraftConfig`, the architecture), checkpoint.py (the trainer's step directories, loaded
without running code), sglang_format.py / mla_format.py (each engine's config fields and tensor names),
aux_layers.py (which target layers the draft reads), export.py (checkpoint -> engine directory),
validate.py with validate_config.py / validate_tensors.py writing into report.py's `DraftReport`, and
convert.py (another trainer's draft -> ours). It imports schemas, regen_service.errors and itself only:
train/ builds and trains the model and deploy/ launches it, both importing draft, so launching a draft
never imports the trainer. No module here imports torch at load time except checkpoint.py.
"""
