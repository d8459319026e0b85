"""Models as the user names them: references and keys (naming), the model list (modellist,
listcsv). Torch-free and network-free."""
