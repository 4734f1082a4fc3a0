"""Workers the controller drives: actor/rollout/reference, critic, reward model (FSDP2)."""
