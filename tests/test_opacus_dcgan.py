"""Opacus's DCGAN example's training loop (examples/dcgan.py: the discriminator on the private batch, then on
``netG(noise).detach()``, ``errD = errD_real + errD_fake``, one backward, the generator's step through
``netD(fake)``), on small offline images with only the import changed: the fake term trains the
discriminator (a public forward: no privacy cost; its rows clipped as the private rows are, the Opacus
interface's default ``public_clip=True``) and the discriminator tells real images from generated ones (D(x)
above D(G(z))). The example reads ``D_x = output.mean().item()`` before the backward and
calls ``netD`` on an undeclared batch: those steps are not proved (the loss could depend on the value read;
the generated batch is not declared public) and the run says so; with the read moved after
``optimizerD.step()`` and ``netD(clipbias.public(fake.detach()))`` it is certified."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import clipbias
from clipbias import PrivacyEngine  # was: from opacus import PrivacyEngine
from clipbias.integrations.session import SIZES_RELEASED

nz, ngf, ndf, nc = 8, 8, 8, 1


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.GroupNorm(min(32, ndf * 2), ndf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.GroupNorm(min(32, ndf), ndf), nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.GroupNorm(min(32, ndf * 2), ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


def _images(n: int = 256) -> TensorDataset:
    """Bright blobs on a dark 16x16 background in [-1, 1] (the example's Normalize(0.5, 0.5) range)."""
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    cy, cx = torch.rand(n, 1, 1, generator=g) * 8 + 4, torch.rand(n, 1, 1, generator=g) * 8 + 4
    img = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 6.0) * 2 - 1
    return TensorDataset(img.unsqueeze(1), torch.zeros(n, dtype=torch.long))


def _train(read_before_backward: bool, epochs: int, n: int = 256):
    torch.manual_seed(0)
    dataloader = DataLoader(_images(n), batch_size=32, shuffle=True)
    netG, netD = Generator(), Discriminator()
    criterion = nn.BCELoss()
    optimizerD = optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    privacy_engine = PrivacyEngine(secure_mode=False)
    netD, optimizerD, dataloader = privacy_engine.make_private(
        module=netD, optimizer=optimizerD, data_loader=dataloader, noise_multiplier=0.8, max_grad_norm=1.0)
    optimizerG = optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    seen = []
    for epoch in range(epochs):
        for i, data in enumerate(dataloader, 0):
            optimizerD.zero_grad(set_to_none=True)
            real_data = data[0]
            batch_size = real_data.size(0)
            label_true = torch.full((batch_size,), 1.0)
            output = real_out = netD(real_data)
            errD_real = criterion(output, label_true)
            if read_before_backward:
                D_x = output.mean().item()
            noise = torch.randn(batch_size, nz, 1, 1)
            fake = netG(noise)
            label_fake = torch.full((batch_size,), 0.0)
            # (the example's own line is netD(fake.detach()); declared public, the step stays certified)
            output = netD(fake.detach() if read_before_backward else clipbias.public(fake.detach()))
            errD_fake = criterion(output, label_fake)
            errD = errD_real + errD_fake
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the unproven steps' warning: the report is asserted)
                errD.backward()
                optimizerD.step()
            optimizerD.zero_grad(set_to_none=True)
            if not read_before_backward:  # (kept as tensors, read after the training: a read between steps
                D_x = real_out.detach().mean()  # could feed a later step's public term)
            D_G_z1 = output.detach().mean()
            optimizerG.zero_grad()
            output_g = netD(fake)
            errG = criterion(output_g, torch.full((batch_size,), 1.0))
            errG.backward()
            optimizerG.step()
            seen.append((D_x, D_G_z1))
            epsilon = privacy_engine.accountant.get_epsilon(delta=1e-5)
    return privacy_engine, seen, epsilon, netG


def test_the_dcgan_examples_loop_trains_the_discriminator_on_both_terms():
    privacy_engine, seen, epsilon, netG = _train(read_before_backward=False, epochs=2)
    last = torch.tensor(seen[-8:])
    assert last[:, 0].mean() > last[:, 1].mean() + 0.05, seen[-8:]  # D(x) above D(G(z)): both terms trained
    report = privacy_engine.privacy_report()
    assert report.certified and 0 < epsilon < 20
    # the generated batch has the private batch's size (torch.randn(batch_size, nz)): that count is released
    assert SIZES_RELEASED in report.released
    assert any(p.grad is not None for p in netG.parameters())  # the generator's step ran through netD(fake)


def test_the_dcgan_examples_read_before_the_backward_is_said_and_uncertified():
    privacy_engine, _, _, _ = _train(read_before_backward=True, epochs=1, n=64)
    report = privacy_engine.privacy_report()
    assert not report.certified
    assert any("could not be proved a sum of per-example terms" in c for c in report.caveats)
