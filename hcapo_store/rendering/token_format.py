"""The column names of the tokenized export, shared by the writer and the trainers that read it.

The conversation's ids are ``token_ids`` — deliberately not ``input_ids``: a trainer that does
not know about the per-token ``advantages`` (TRL's plain ``SFTTrainer``, the transformers
``Trainer``) finds no input column and stops, instead of fine-tuning on the credited tokens
with every advantage ignored.
"""

TOKEN_IDS = "token_ids"
COLUMNS = (TOKEN_IDS, "labels", "advantages")  # equal lengths, one value per token
FINGERPRINT_KEYS = ("tokenizer_files_sha256", "chat_template_sha256")  # in each row's provenance
IGNORE_INDEX = -100  # the label PyTorch's cross-entropy ignores
