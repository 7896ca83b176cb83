"""Small models written for whalex's tests after public architectures (each file names the one it
follows), each keeping the idioms of the public implementations that a plan in parts meets (masks
broadcast to the batch size, a class token tiled over the batch, batch statistics): Llama (a decoder
with rotary embeddings and Hugging Face's mask handling), T5 (an encoder-decoder with relative
position biases and cross-attention), ViT (patch embedding, class token, encoder blocks) and ResNet
(convolutions with BatchNorm), the Llama and the ResNet in Flax NNX too. `annotate` places a plan's
annotations in them and `plans` lists the plan kinds they train under. Sizes are tiny so that every
plan kind trains them in seconds."""
