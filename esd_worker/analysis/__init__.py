"""The analysis of one model on torch: its checkpoint (weights), layers (layers), LoRA merges
(lora), spectra (spectra, speculate) over devices (streams), end to end (analyze).

Imported only once a model is to be analysed: importing it imports torch."""
