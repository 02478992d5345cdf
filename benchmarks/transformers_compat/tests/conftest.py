"""Substitute ``DynaQuantTrainer`` for ``transformers.Trainer`` when asked to.

With ``HF_DYNAQUANT_COMPAT_TRAINER=dynaquant`` the name ``Trainer`` in ``transformers`` is bound
to :class:`hf_dynaquant.DynaQuantTrainer` before the test modules are imported, so every
``from transformers import Trainer`` in them (module level and inside test functions) gets ours:
the tests run exactly as a user who swaps the class name would run them. Without it the stock
``Trainer`` runs. This is a substitution of the class under test, not a mock of a dependency.
"""

import os

if os.environ.get("HF_DYNAQUANT_COMPAT_TRAINER") == "dynaquant":
    # (imported after hf_dynaquant: loading the Trainer replaces sys.modules["transformers"])
    import transformers

    from hf_dynaquant import DynaQuantTrainer

    transformers.Trainer = DynaQuantTrainer
