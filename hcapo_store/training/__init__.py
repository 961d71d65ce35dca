"""Training on a tokenized export: the rows' checks (``data``, no torch) and the loss and
trainers (``loss`` needs torch; ``trl_sft`` needs TRL)."""
