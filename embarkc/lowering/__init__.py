"""The parts of `embarkc.lower`: one module per block of the language, one for the checks
across blocks, and `base` with what they share."""
