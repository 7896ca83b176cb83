"""Small models written for whalex's tests after public architectures, each keeping the idioms of the
public implementations that a plan in parts meets (masks broadcast to the batch size, a class token
tiled over the batch, batch statistics): Llama (a decoder with rotary embeddings and Hugging Face's
mask handling), ViT (patch embedding, class token, encoder blocks) and ResNet (convolutions with
BatchNorm). Sizes are tiny so that every plan kind trains them in seconds."""
