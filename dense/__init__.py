"""Dense side: tokenizers, towers (chosen by name) and task heads."""
