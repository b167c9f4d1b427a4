"""What other training code imports: the label reader, the webdataset select and weighted loss,
open_clip's trainer with our model configs (see docs/architecture.md §1). Imports only io, core
and models."""
