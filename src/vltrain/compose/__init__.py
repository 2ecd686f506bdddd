"""What every command is made of: the config decided once (:mod:`~vltrain.compose.decide`), the
tokenizer, model, task and loaders it describes (:mod:`~vltrain.compose.builders`,
:mod:`~vltrain.compose.task`) and the one door that opens a model (:mod:`~vltrain.compose.opening`).

It sits above ``checkpoint/`` (whose files the door reads) and below ``export/``, ``eval/`` and
``train/``, which all build and open models through it: no import climbs back up."""
