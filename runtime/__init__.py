"""embark_runtime: what generated trainers import. Knows plans, never the compiler.

Importing this package is cheap (no torch); the torch-using modules are imported on use.
"""

__version__ = "0.1.0"
