# expect: none
"""A GAN-style loop: two optimizers, each stepped after its own backward, each zeroing its own gradients."""
import torch

torch.manual_seed(0)
generator = torch.nn.Linear(4, 8)
discriminator = torch.nn.Linear(8, 1)
opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
bce = torch.nn.BCEWithLogitsLoss()
for step in range(3):
    real, noise = torch.randn(4, 8), torch.randn(4, 4)
    opt_d.zero_grad()
    fake = generator(noise).detach()
    loss_d = bce(discriminator(real), torch.ones(4, 1)) + bce(discriminator(fake), torch.zeros(4, 1))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    loss_g = bce(discriminator(generator(noise)), torch.ones(4, 1))
    loss_g.backward()
    opt_g.step()
