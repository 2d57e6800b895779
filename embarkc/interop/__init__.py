"""Interoperability with TorchRec and HugeCTR: importing their model descriptions as specs
(`spec_import`), measuring access statistics from data (`profile`), exporting plans in
their sharding formats (`plan_export`, `torchrec_plan`) and planning within what they can
run (`targets`). docs/interop.md is the user's guide.

Nothing here imports torch or torchrec at module level: `torchrec_plan` imports them when
it is called.
"""
