"""Test access to the episode writer, which ships in the package (the demo and benches use it)."""

from hcapo_store.devkit.synth import EpisodeBuilder, words, write_bad_episodes, write_standard_episodes  # noqa: F401
