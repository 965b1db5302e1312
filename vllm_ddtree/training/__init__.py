# SPDX-License-Identifier: Apache-2.0
"""Training a small target LM and a DFlash drafter for it (plain torch).

``python -m vllm_ddtree.training.train_pair --preset tiny --out DIR`` trains
both and writes them in the HF layout vLLM loads; see ``train_pair.py``.
"""
