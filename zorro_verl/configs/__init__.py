"""The Hydra presets of zorro_verl, shipped as package data: `--config-path=pkg://zorro_verl.configs`
`--config-name=zorro_ppo_trainer` (verl >= 0.9, FSDP), `zorro_megatron_trainer` (verl >= 0.9, Megatron) or
`zorro_legacy` (verl 0.7). Documented in configs/README.md."""
