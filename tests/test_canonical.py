"""One canonical JSON function; every id and hash stored by earlier versions is unchanged.

The expected digests were computed with the two separate functions that existed before
they were merged (scorer ids kept non-ASCII as UTF-8, credit-run hashes escaped it).
"""

from hcapo_store.canonical import canonical_json, content_hash
from hcapo_store.credits.equations import CreditParams, run_hash
from hcapo_store.scoring.scorer import scorer_id

SPEC = {
    "backend": {"kind": "sglang", "model": "Qwen3-8B-Ünïcode", "server_model": "模型"},
    "max_context": 32768,
    "hindsight_template": "Résumé ☃",
}
SCORER_ID = "03d7f0d8b220a356f16d7ce242673b4692d45e9510b110b986cae1c9d5381a63"


def test_scorer_id_of_a_non_ascii_spec_is_unchanged():
    assert scorer_id(SPEC) == SCORER_ID


def test_run_hashes_are_unchanged():
    assert run_hash(SCORER_ID, CreditParams()) == "8d3d1c8cc7a8473f8d064f3728c29c016ae9fb72c7d8e833862539819b184cf6"
    assert run_hash(SCORER_ID, CreditParams(gamma=0.5)) == (
        "cd75d68248f75101cab85ec16f7df180552a0532e3f4278677605a817c200067"
    )


def test_the_two_forms_differ_only_in_escaping():
    obj = {"b": "é", "a": [1, 2.5, None]}
    assert canonical_json(obj) == '{"a":[1,2.5,null],"b":"é"}'
    assert canonical_json(obj, ascii_only=True) == '{"a":[1,2.5,null],"b":"\\u00e9"}'
    assert content_hash(obj) != content_hash(obj, ascii_only=True)
