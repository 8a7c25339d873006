"""The trainer with what later recipes need: two optimizers stepped alternately and a frozen module.

A VSRN variant for the test only: optimizer 'image' owns the image encoder, 'text' the text encoder
and caption decoder, and the word embeddings are frozen (as CL's reference model is). Even steps
update the image side against detached caption embeddings, odd steps the text side against
detached image embeddings, so each step leaves half the parameters without gradient (DDP must be
told: Recipe.dynamic_graph). Run under torchrun by tests/integration/test_alternating_updates.py.
"""

import logging
import sys

import vldist.recipes
from vldist.losses import cross_rank_token_nll, cross_rank_vse_hinge_loss
from vldist.recipes.jobs import load_config
from vldist.recipes.vsrn import VSRNRecipe
from vldist.training.on_each_rank import run


class AlternatingVSRN(VSRNRecipe):
    dynamic_graph = True

    def build_model(self):
        model = super().build_model()
        model.text.embed.requires_grad_(False)
        return model

    def optimizer_groups(self, model):
        image = [p for p in model.image.parameters()]
        text = [p for m in (model.text, model.decoder) for p in m.parameters() if p.requires_grad]
        return {"image": image, "text": text}

    def updates(self, step):
        return ("image",) if step % 2 == 0 else ("text",)

    def losses(self, out, batch, update="main", model=None):
        image, text = out["image"], out["text"]
        if update == "image":
            loss = cross_rank_vse_hinge_loss(image, text.detach(), self.cfg.margin, False, True)
        else:
            caption = cross_rank_token_nll(out["caption_logits"], batch["tokens"][:, 1:], self.vocab.pad_id)
            loss = cross_rank_vse_hinge_loss(image.detach(), text, self.cfg.margin, False, True) + caption
        return {"loss": loss, "matching": loss.detach()}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    vldist.recipes.RECIPES["vsrn"] = AlternatingVSRN
    run(load_config("vsrn", sys.argv[1:]))
