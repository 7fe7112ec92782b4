"""Model classes the project defines: Dream-style masked-diffusion LMs (``dream``), and DiffusionGemma with Gemma 3's
value path (``diffusiongemma``). Each imports only torch and transformers, so a saved model can carry its file as
remote code."""
