"""The policies (diffusers pipelines, causal LMs), their LoRA / full fine-tune weights, tiny offline models."""

# The diffusers pipelines a diffusion policy can be (``model_index.json``'s ``_class_name``): each has an adapter in
# ``diffusion_policy``; ``config.model_paths`` refuses a checkpoint of any other class at start, before Ray.
SUPPORTED_PIPELINES = (
    "QwenImagePipeline",
    "StableDiffusion3Pipeline",
    "WanPipeline",
    "QwenImageEditPipeline",
    "QwenImageEditPlusPipeline",
    "FluxPipeline",
)
