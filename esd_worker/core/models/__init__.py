"""Models as the user names them: references and keys (naming), the model list (modellist,
listcsv); and their files: which are the weights (weightfiles), what a safetensors header
holds (safetensors). Torch-free and network-free."""
