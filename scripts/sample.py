r"""Samples from a checkpoint of a training run; all logic lives in `sparse_jax.sample`.

  python scripts/sample.py --workdir=workdirs/quickstart --num_samples=4 --length=512 \
      --temperature=0.9 --top_p=0.95 --prompt="eta"
  python scripts/sample.py --workdir=workdirs/cifar10 --num_samples=16     # a PNG grid
  python scripts/sample.py --workdir=workdirs/cifar10 --complete=8         # completions grid

Text: prints the samples and writes them (raw bytes, a header line before each) to
DIR/samples/<step>_seed<S>.txt. --prompt is UTF-8 text; --prompt_file is read as raw bytes.
Images: DIR/samples/<step>_seed<S>.png, or with --complete=N the bottom halves of N images of
--split (spread evenly over it) completed from their top halves, in one PNG grid of three rows
(originals, the top halves shown, completions): DIR/samples/<step>_complete_<split>_seed<S>.png.
--output sets the path. The same --seed gives the same samples. Decoding uses a pattern-aware
key/value cache: each new byte costs O(|S_i| d) per layer, not a forward pass over the context.
Text samples are of any --length that fits in memory (one that cannot is refused before the
checkpoint loads): past the context n the window slides (a full window is followed by one that
re-reads its last n/2 bytes from position 0; each byte sees n/2 to n bytes, and costs about two
cached steps past the first window), and a sample of more than 4 windows shows its progress. A
prompt longer than n is cut to its last n bytes, with one warning line. An image sample is
always one whole image (a picture model's window never slides).
--attention reads the run with another attention implementation (default: the run's, or XLA
where its CPU kernels cannot run here).
"""

from absl import flags

from sparse_jax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by scripts/train.py.")
_NUM = flags.DEFINE_integer("num_samples", 4, "Samples (text continuations or images).")
_LENGTH = flags.DEFINE_integer("length", None, "Text: new bytes per sample, any number (default "
                               "256; past the context the window slides). Images: always one "
                               "whole image.", upper_bound=2**62)  # check_length says what fits
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Sample among the k most likely bytes.")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling: smallest set with mass >= p.")
_PROMPT = flags.DEFINE_string("prompt", None, "Text prompt (UTF-8). Default: a newline.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Prompt read as raw bytes.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the samples (.txt / .png).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "latest", "latest | best | a step number.")
_COMPLETE = flags.DEFINE_integer("complete", 0, "Images: complete the bottom halves of N "
                                 "images (e.g. 8) of --split from their top halves.")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "valid", "test"], "Images for --complete.")
_ATTENTION = flags.DEFINE_enum("attention", None, ["xla", "native", "pallas", "auto"],
                               "Attention implementation to read the run with (default: the "
                               "run's, or XLA where its CPU kernels cannot be built here).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing output file.")
flags.mark_flags_as_required(["workdir"])


def _arguments() -> dict:
    return dict(
        workdir=_WORKDIR.value, num_samples=_NUM.value, length=_LENGTH.value,
        temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
        prompt=_PROMPT.value, prompt_file=_PROMPT_FILE.value, seed=_SEED.value,
        output=_OUTPUT.value, checkpoint=_CHECKPOINT.value, complete=_COMPLETE.value,
        split=_SPLIT.value, attention=_ATTENTION.value, overwrite=_OVERWRITE.value)


def check(argv):
    """Every flag, the run and its checkpoint, before any parameter is read
    (`sample.check_arguments`)."""
    cli.no_arguments(argv)
    cli.input_dir("workdir", _WORKDIR.value, "the folder of a training run")
    cli.input_file("prompt_file", _PROMPT_FILE.value)
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value)
    from sparse_jax import sample

    sample.check_arguments(**_arguments())


def main(argv):
    from sparse_jax import sample

    result = sample.sample(**_arguments())
    if not result["image"]:
        for k, text in enumerate(result["samples"]):
            print(f"===== sample {k + 1} =====")
            print(text.decode("utf-8", errors="replace"))
    print(f"Wrote {result['path']} (step {result['step']}, {result['seconds']:.1f} s, "
          f"{result['tokens_per_s']:,.0f} tokens/s including compilation)")


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
