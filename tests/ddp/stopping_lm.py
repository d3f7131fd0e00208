"""The small demo model the resume scripts of ``tests/ddp`` train, stopped by an error inside a training step."""

from lit_balance.demo import DemoTransformerLM


class StoppingLM(DemoTransformerLM):
    """:class:`~lit_balance.demo.DemoTransformerLM` that raises in ``training_step`` at micro-batch ``stop_at`` (of
    epoch ``stop_epoch``; of any epoch when None). ``stop_at`` None: it never stops."""

    def __init__(self, vocab_size: int, stop_at: int | None = None, stop_epoch: int | None = None) -> None:
        super().__init__(vocab_size=vocab_size, d_model=16, num_heads=2, num_layers=1, dim_feedforward=32)
        self.stop_at, self.stop_epoch = stop_at, stop_epoch

    def training_step(self, batch, batch_idx):
        if batch_idx == self.stop_at and self.stop_epoch in (None, self.trainer.current_epoch):
            raise RuntimeError("simulated stop inside training_step")
        return super().training_step(batch, batch_idx)
