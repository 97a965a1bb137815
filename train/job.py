"""The training job's defaults, held once: ``train/run.py``'s flags and
``train.step.make_optimizer`` read them here (no jax import: read before JAX starts)."""

DEFAULTS = dict(mesh="2x4", preset="small", steps=400, batch_size=32, seq_len=128, lr=3e-3,
                warmup_steps=40, weight_decay=0.1, grad_clip=1.0, dropout=0.0,
                dtype="float32", seed=0, eval_every=100, checkpoint_every=0, keep_checkpoints=3,
                sample_prompt="def ", sample_length=200, init_timeout=60, heartbeat_timeout=20)
