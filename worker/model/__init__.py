"""Model loading and the Llama-family decoder (torch)."""
