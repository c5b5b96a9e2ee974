"""The training demo: a small GPT trained on a text corpus shipped with the package."""
