"""The analysis of one model on torch: its checkpoint (weights) and its layer map (layers, or
knownmaps from config.json alone), LoRA merges (lora), each layer's work (modellayers: the
weights staged through host buffers, staging; spectra, speculate; host eigensolvers and fits,
hostsolve) over devices (streams), end to end (analyze).

Imported only once a model is to be analysed: importing it imports torch."""
