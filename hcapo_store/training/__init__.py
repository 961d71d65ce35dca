"""Training on the store's credits: a tokenized export's checks (``data``, no torch), the loss
and TRL trainers (``loss`` needs torch; ``trl_sft`` and ``trl_grpo`` need TRL), the hand-off of
a credit run's advantages onto a trainer's ids (``handoff``) and the shapes other frameworks
take them in (``adapters``)."""
