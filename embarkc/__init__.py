"""embarkc: plans embedding sharding for recommendation models and generates the trainer."""

__version__ = "0.1.0"
