"""regen: regenerate EAGLE-3 draft training data with the target model, at scale.

The library behind the `regen` CLI, the Celery workers and the trainer consumer.
"""

__version__ = "0.1.0"
