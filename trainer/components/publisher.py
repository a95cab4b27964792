"""Publishing while training (`[publish]`) as a component of the loop: a serving artifact and
its delta (trainer/serving/publish.py `Publisher`) after every publish.every_steps steps and at
every partition's end (publish.every_partition)."""

from __future__ import annotations

from trainer.components.base import Loop, LoopComponent
from trainer.serving.publish import Publisher


class Publishing(LoopComponent):
    """When the loop publishes, through `publisher`, whose delta base (`previous`) is its state."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher

    def after_checkpoint(self, loop: Loop) -> None:
        if self.publisher.due(loop.step):
            self.publish_run(loop, f"step-{loop.step}")

    def partition_end(self, loop: Loop, partition: str) -> None:
        if self.publisher.cfg.publish.every_partition:
            self.publish_run(loop, partition, partition)

    def publish_run(self, loop: Loop, name: str, partition: str | None = None) -> None:
        """The run's model as it is after this step, once the flags are read and no save is in flight."""
        loop.check()
        loop.wait_for_save()  # one save at a time
        folder = self.publisher.publish(name, loop.step, loop.weights(), partition)
        loop.logger.write(f"published {folder}")
        loop.logger.artifact(name, str(folder))

    def state_dict(self) -> dict:
        return {"previous": self.publisher.previous}

    def load_state_dict(self, state: dict) -> None:
        self.publisher.previous = state["previous"]
