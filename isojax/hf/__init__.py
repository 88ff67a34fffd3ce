"""The one boundary with Hugging Face: the hub (network), checkpoint files (files), loading with
fallbacks (loading), the GPT-NeoX name mapping and conversion (gpt_neox, orbax_io), tokenizers."""
