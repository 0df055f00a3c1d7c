"""Training pi0.5 on a LeRobotDataset with its own objectives (``oxygen-train``).

* :mod:`.dataset`        the dataset's frames, with held narrations and episode ends;
* :mod:`.normalization`  quantile statistics and the normalisers the loader will rebuild;
* :mod:`.augment`        openpi's image augmentation, seeded;
* :mod:`.batches`        frames -> model-space batches (images, prompts, text targets, chunks);
* :mod:`.schedule`       warmup + cosine learning rate;
* :mod:`.trainer`        the loop;
* :mod:`.checkpoint_out` the LeRobot folder, tokenizer and record it writes.

The losses themselves are in ``oxygen_ros.model.objectives``.
"""
