"""The rendering engine: conversation → text → token ids, below scoring, outputs and training.

* ``template``: chat templates compiled in the project's own sandbox (the text of
  ``apply_chat_template``);
* ``tokenizers``: loading a tokenizer and its content fingerprint (``tokenizer_memo``: the class
  ``AutoTokenizer`` chose, recorded for later processes, which load through it without torch);
* ``segments``: tokenizing rendered text piece by piece between added tokens, bit-identical
  to the tokenizer;
* ``own_tokens``: the policy's own characters of an action inside a rendering;
* ``placement``: every step's own tokens placed in one rendering of the whole conversation;
* ``prompts``: the per-step hindsight prompts (``requests``: what a prompt is in ids), built
  from ``hindsight`` (the outcome block) and ``messages`` (normalized, flattened);
* ``prompt_rule``: the per-step rule stated plainly (whole history; whole turns), which the
  fast strategies stand in for: ``bounded`` (long sliding/window sessions) and ``turn_windows``;
* ``verify``: every fast strategy's rule and check policy, the fallbacks counted, and the
  reference mode (``HCAPO_RENDERING=reference``: the rules only);
* ``episode_layout``: one rendering per episode, cut into windowed requests.
"""
