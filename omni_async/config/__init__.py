"""The configuration: the Hydra YAML files (``flowgrpo_trainer.yaml``, ``grpo_text_trainer.yaml``), their typed
schema (``schema``), verl's and verl-omni's upstream spellings and what each means here (``upstream_keys``,
``overrides``) and the model paths checked at start (``model_paths``). It reads no runtime code: the trainer validates
a composed config and decides its mode and layout from it (``omni_async.trainer.config``)."""
